# The simulator's hot modules may be compiled (make compiled): choose their build before any of them is imported.
from octoserve.services import compiled as _compiled

_compiled.activate()
