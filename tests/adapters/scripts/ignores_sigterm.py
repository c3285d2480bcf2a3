"""Ignore SIGTERM, write the pid to PIDFILE, print a word and sleep forever: only SIGKILL works.

Usage: ignores_sigterm.py PIDFILE
"""

import os
import signal
import sys
import time

signal.signal(signal.SIGTERM, signal.SIG_IGN)
with open(sys.argv[1], "w") as pidfile:
    pidfile.write(str(os.getpid()))
sys.stdout.write("stubborn")
sys.stdout.flush()
while True:
    time.sleep(60)
