"""Everything that registers with fairseq: the ls_transformer model and its archs, the
ls_adam optimizer, the ls_label_smoothed_cross_entropy criterion.

This is the ONE module that performs registrations. Python imports it once per process,
however many times ``--user-dir`` or ``lightseq-*`` ask for it, so nothing is registered
twice (fairseq raises on a duplicate name).
"""

from ls_fairseq.fairseq_ext import patches

patches.install_at_import()  # fairseq-fixed fixes, before anything loads; the training loop's trainer choice
from ls_fairseq.fairseq_ext import model  # noqa: F401
from ls_fairseq.fairseq_ext import criterion  # noqa: F401
from ls_fairseq.fairseq_ext import optimizer  # noqa: F401
