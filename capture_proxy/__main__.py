import sys

from capture_proxy.cli import main

sys.exit(main())
