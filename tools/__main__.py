import sys

from tools.cli import main

sys.exit(main(sys.argv[1:]))
