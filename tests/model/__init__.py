"""The pure-Python reference model of the compiled core (``core/src/partition.rs``) and its tests."""
