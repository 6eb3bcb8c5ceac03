"""Hot vocabulary: count target-token frequencies over a corpus and select the hot set."""
