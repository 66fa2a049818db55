"""Training scripts for the models kvmesh ships (models/): run them with ``python -m train.<script>``."""
