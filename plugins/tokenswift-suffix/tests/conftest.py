import os

import torch

# These tests exercise the installed plugin through tokenswift's entry-point loading.
os.environ.pop("TOKENSWIFT_DISABLE_PLUGINS", None)
torch.set_num_threads(min(2, os.cpu_count() or 1))
