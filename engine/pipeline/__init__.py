"""Pipeline-parallel inference across peers: planning, shards, workers, coordinator."""
