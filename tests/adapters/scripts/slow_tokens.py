"""Print COUNT words one at a time, DELAY seconds apart, flushing each: a streaming backend.

Usage: slow_tokens.py COUNT DELAY [PIDFILE]
"""

import os
import sys
import time

count, delay = int(sys.argv[1]), float(sys.argv[2])
if len(sys.argv) > 3:
    with open(sys.argv[3], "w") as pidfile:
        pidfile.write(str(os.getpid()))
for index in range(count):
    if index:
        time.sleep(delay)
    sys.stdout.write(("" if index == 0 else " ") + f"w{index}")
    sys.stdout.flush()
