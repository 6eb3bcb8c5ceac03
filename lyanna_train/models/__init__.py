"""The Lyanna draft: an EAGLE-3-layout head over the hot vocabulary, a state pool and an α-gate."""
