"""``python -m moto.server`` as the tests start it (``stores.S3Server``), without two costs it pays on every
request that have nothing to do with S3: its dispatcher lists moto's ~150 service folders on disk (a
``listdir`` and an ``isdir`` each) to route a request, and werkzeug logs a line per request. The folders are
listed once here, and werkzeug logs warnings only. Same arguments as ``python -m moto.server``."""

import logging
import sys

from moto import backends, server

MODULES = tuple(backends.list_of_moto_modules())
backends.list_of_moto_modules = lambda: MODULES
logging.getLogger("werkzeug").setLevel(logging.WARNING)

if __name__ == "__main__":
    server.main(sys.argv[1:])
