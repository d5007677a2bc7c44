import logging
import os
import sys

from launcher.cli import main

code = main()
# Everything is stopped and cleaned up by now: skip the interpreter's teardown, which takes seconds once torch is
# loaded (`serve` imports it to choose the dtype) and which whoever waits for this process would wait out.
logging.shutdown()
sys.stdout.flush()
sys.stderr.flush()
os._exit(code or 0)
