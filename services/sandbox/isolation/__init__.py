"""The sandbox's isolation primitives: bubblewrap, cgroups, mounts, network, processes, archives."""
