"""Print a little, write a lot of noise and then the reason to stderr, and exit 3."""

import sys

sys.stdout.write("partial output")
sys.stdout.flush()
sys.stderr.write("noise " * 2000)
sys.stderr.write("\nthe real reason: model file is corrupt\n")
sys.exit(3)
