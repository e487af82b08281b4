"""What the sections share: the lab every section runs in (scratch directory, CA, archway's
config), the servers under measurement, the load generator, statistics, the figures table, the
one skeleton of a section, and the 5,000-node cluster of the extender figures."""
