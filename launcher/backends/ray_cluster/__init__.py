"""The Ray backend (`--backend ray`): stage actors in one placement group (stage_actors.py), what Ray
tells the user (messages.py), and whether a node is alive (nodes.py). The only package of the project
that imports ray."""
