"""What every role of the cluster shares: the stage protocol (stage.proto and its stubs),
tensors on the wire, authentication, zeroconf discovery, checkpoint fingerprints and the
JACCL node reports. Imports nothing else of the cluster."""
