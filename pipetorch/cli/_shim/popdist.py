"""Stand-in `popdist` for child interpreters of `pipetorch run`: it becomes pipetorch.popdist."""
import sys

import pipetorch.popdist
from pipetorch.cli.alias import install_poptorch_alias

install_poptorch_alias()  # so that `popdist.poptorch` resolves as well
# The import system returns whatever sys.modules holds once the module body has run.
sys.modules[__name__] = pipetorch.popdist
