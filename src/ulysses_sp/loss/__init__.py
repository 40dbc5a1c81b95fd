"""Loss aggregation for sharded sequences.

Main entry points:
    answer_scores(logits, shift_labels, group) -> AnswerScores
                                            per-sample log-likelihood / accuracy of answer tokens
                                            (passkey retrieval) of the whole SP group, from the
                                            local shard; answer_positions for logits_to_keep
    global_num_items(shift_labels, group)   valid tokens of the whole step (one all-reduce)
    sp_token_loss(logits, shift_labels, num_items_in_batch, grad_average_world=W)
                                            this rank's loss; the DP gradient average of it is the
                                            exact global token-mean gradient
    reported_loss(loss, W, group)           the global token-mean loss value for logging
    tiled_token_loss(hidden, lm_head_weight, shift_labels, num_items_in_batch, grad_average_world=W)
                                            sp_token_loss of lm_head(hidden), tile by tile, never
                                            materialising the full (B, s, V) logits
    sp_router_aux_loss(router_logits, top_k, valid, group)
                                            this rank's share of the MoE load-balancing loss of
                                            the whole sequence
"""

from ulysses_sp.loss.answer_score import AnswerScores, answer_positions, answer_scores
from ulysses_sp.loss.cross_entropy import global_num_items, reported_loss, sp_token_loss
from ulysses_sp.loss.router_aux import sp_router_aux_loss
from ulysses_sp.loss.tiled import tiled_token_loss

__all__ = ["AnswerScores", "answer_positions", "answer_scores", "global_num_items", "reported_loss",
           "sp_router_aux_loss", "sp_token_loss", "tiled_token_loss"]
