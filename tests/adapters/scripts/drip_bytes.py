"""Write TEXT as UTF-8 one byte at a time with a pause, so multi-byte characters straddle reads."""

import sys
import time

for byte in sys.argv[1].encode("utf-8"):
    sys.stdout.buffer.write(bytes([byte]))
    sys.stdout.flush()
    time.sleep(0.005)
