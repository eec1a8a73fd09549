"""Where bytes live and how they move: the one device-specific seam."""
