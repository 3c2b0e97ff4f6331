"""Tools around the service: the demo, the chaos run and its audit."""
