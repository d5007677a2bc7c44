"""TGI's API: its routes and the structs they decode and encode."""
