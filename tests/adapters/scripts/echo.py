"""Print the arguments, then copy stdin to stdout chunk by chunk as it arrives.

With --stderr N, first write N bytes to stderr (to check that stderr is drained concurrently).
"""

import sys

args = sys.argv[1:]
if args[:1] == ["--stderr"]:
    sys.stderr.write("e" * int(args[1]))
    sys.stderr.flush()
    args = args[2:]
sys.stdout.write(" ".join(args))
sys.stdout.flush()
while chunk := sys.stdin.buffer.read1(65536):
    sys.stdout.buffer.write(chunk)
    sys.stdout.flush()
