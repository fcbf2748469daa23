"""What the controller writes: the JSON report and verdict (``documents``), the terminal summary (``summary``)."""
