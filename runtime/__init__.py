"""The shared runtime of every service and client: the NATS edge (bus), settings,
credentials reading, and the topology (streams and buckets) they all run on."""
