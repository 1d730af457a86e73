"""Print how the script was run (``__name__``, ``sys.argv``, ``sys.path[0]``) as JSON."""

import json
import sys

print(json.dumps({"name": __name__, "argv": sys.argv, "path0": sys.path[0], "file": __file__}))
