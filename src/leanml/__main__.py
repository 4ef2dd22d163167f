import sys

from leanml.cli import main

sys.exit(main())
