"""swarmrl: the command line (`swarmrl <role>`) and the local demo swarm."""
