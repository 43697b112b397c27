"""Su's mixed heads where he proposed them: mixed vs bidirectional attention on a masked LM,
paired seeds, a unigram gate."""
