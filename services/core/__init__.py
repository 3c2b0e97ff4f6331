"""What every layer may use: settings, the error taxonomy, and checks on what strangers send
(server paths, object keys, regular expressions, request bodies)."""
