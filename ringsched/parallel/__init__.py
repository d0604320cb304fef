"""Where ranks sit: a rank's place in the layout (`rank`), the layer partition and its `auto` probe, and the
flexible cut between two stages (`flex`, with its K/V mirror `flex_ring` and its `ready` policy)."""
