"""What `analyze` tells a user before converting: which layers split and how, memory per rank and the world size
to use (`analyze`), the sentences that explain its plan (`recommend`), what changes beyond one machine
(`multinode`), and the line a conversion logs when layers stayed whole (`notices`)."""
