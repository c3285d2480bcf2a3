"""Start a sleeping grandchild, write "PID GRANDCHILD_PID" to PIDFILE, print a word, then sleep
(or, with --exit, exit at once and leave the grandchild behind, still holding our stdout).

Usage: spawns_child.py PIDFILE [--exit]
"""

import os
import subprocess
import sys
import time

child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
with open(sys.argv[1], "w") as pidfile:
    pidfile.write(f"{os.getpid()} {child.pid}")
sys.stdout.write("spawned")
sys.stdout.flush()
if "--exit" in sys.argv:
    os._exit(0)  # no wait for the child: it is left running
while True:
    time.sleep(60)
