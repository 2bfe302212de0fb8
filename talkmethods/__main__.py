import sys

from talkmethods.cli import main

sys.exit(main())
