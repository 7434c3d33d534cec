"""`distplan validate`'s machinery: probes, runner, results, comparison (see each module).

Importing any of it installs one warnings filter: torch's "UserWarning: Failed to initialize NumPy"
(printed at `import torch` where NumPy is missing or does not match torch's build) is silenced, and
nothing else: the probes and the `--module` workloads use no NumPy.
"""

import warnings as _warnings

_warnings.filterwarnings("ignore", message=r"Failed to initialize NumPy", category=UserWarning)
