"""Su's mixed heads where he proposed them (issue 14, item 6): mixed vs bidirectional attention on a masked LM,
paired seeds, a unigram gate."""
