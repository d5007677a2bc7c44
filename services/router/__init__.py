"""Router: binds the well-known bus addresses, runs the intake streamer and the event proxy, and
places each tokenized request on a model replica and a detokenizer shard."""
