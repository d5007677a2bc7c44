"""Every timing constant of the recovery protocol, in one place (docs/recovery.md tells the protocol).

A process is alive while its heartbeats come; everything else is sized from that: a peer counts as gone a
heartbeat lifetime after its last beat, a request waits about that long for a restarting peer, and state kept
for a late resync or a late abort outlives the longest outage a restart can cause. Change one, read the table
in docs/recovery.md first.
"""

from __future__ import annotations

# -- liveness (every process) --
HEARTBEAT_S = 1.0  # every process publishes a heartbeat this often
STALE_AFTER = 3.0  # seconds without a heartbeat before a process counts as gone (a heartbeat lifetime)
VIEW_STALL_S = 1.5  # a loop turn this late (it polls every 0.5 s) means its view of the heartbeats missed time
TP_PEER_STALE_S = 5.0  # a tensor-parallel rank silent this long is gone (its own, faster side channel)
# A role lost less than this long ago (its last process went stale or left, or the view is younger) is taken
# for restarting: a request that needs it waits for it (http: a tokenizer; the router: a detokenizer and a
# scheduler) instead of failing at once with 503 (Liveness.awaited). A heartbeat lifetime: after a kill -9
# that is two, counted from the death, as the loss itself is seen a lifetime late
RESTART_WAIT_S = STALE_AFTER

# -- http: the requests it holds --
ADMIT_TIMEOUT = 30.0  # seconds for a request to be accepted or rejected once submitted
STALL_S = 2.5  # seconds without an event before the watchdog resubmits (not accepted) or asks for a resync
GIVE_UP_S = 30.0  # seconds without any event (a waiting request's scheduler answers resyncs) before failing it
# How long an aborted, never-accepted request is remembered, to abort it when its Accepted comes at last: a copy
# may wait in the router's queue for a scheduler that is down (restarting, or its host away) far past
# ADMIT_TIMEOUT, and run when that scheduler is back
ABANDONED_KEEP_S = 300.0

# -- scheduler: the streams it can replay --
GRACE_S = 30.0  # an ended request's rows are kept this long, for a late resync
GRACE_MAX = 2_000  # and at most this many ended requests
FORGET_S = 60.0  # an aborted-before-arrival id is remembered this long
FORGET_MAX = 20_000
REPLAY_EVERY = 0.5  # seconds between two replays of the same request (http and a detokenizer may both ask)

# -- detokenizer --
RESYNC_EVERY = 1.0  # seconds between two resync requests for the same request
FORGET_AFTER = 10_000  # ended request ids remembered, so late rows are dropped quietly
