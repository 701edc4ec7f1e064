"""The shared runtime of every service and client: the NATS edge (`process`: a
service's connection and loop; `consumers`: durable pull consumers; `publishing`;
`settling`: ack, retry, give up; `giving_up`: dead letters and abandoned calls;
`stage`: the stage runner over them), settings, credentials reading, and the
topology (streams, buckets, the handler table) they all run on."""
