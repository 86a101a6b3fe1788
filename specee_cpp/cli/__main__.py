"""`python -m specee_cpp.cli`: the `specee-cpp` command."""
from . import main

main()
