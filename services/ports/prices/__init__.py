"""Instance prices: the catalog file (embedded) and AWS spot prices (production)."""
