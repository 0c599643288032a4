"""The checkpoint protocol (the one definition of complete), its header-only structure checks and ckpt-check."""
