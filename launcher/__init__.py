"""The `switchyard` command line: serve (flags → settings → supervisord), and later tap and bench."""
