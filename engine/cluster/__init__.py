"""Several machines: a node and the plan it shares (``node``), node 0's links to the others (``links``), a node agent (``agent``)."""
