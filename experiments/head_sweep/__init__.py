"""The head-size sweep: prefix - causal against n_in / d_head at equal parameters, with the
trained input block's effective rank: does Su's low-rank argument show in the loss?"""
