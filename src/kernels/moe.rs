//! Mixture-of-experts routing, as transformers' top-k routers compute it (Mixtral, Qwen2-MoE,
//! Qwen3-MoE): a softmax over each token's router logits in f32, its `top_k` most probable
//! experts (ties to the lower index, as `torch.topk` on the CPU), their probabilities
//! renormalized to sum 1 where the model asks for it. Devices route on the host (the CPU)
//! or in a kernel of the same rules (CUDA).

/// How a mixture-of-experts block routes and computes its experts.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MoeSpec {
    /// Experts in the block.
    pub experts: usize,
    /// Experts each token takes.
    pub top_k: usize,
    /// The chosen experts' probabilities divided by their sum (`norm_topk_prob`; always in
    /// Mixtral).
    pub renormalize: bool,
    /// Each expert's gated MLP activation.
    pub act: super::Activation,
}

/// Each row's chosen experts and their weights, `top_k` per row, most probable first.
pub fn route(logits: &[f32], spec: MoeSpec) -> (Vec<u32>, Vec<f32>) {
    let (e, k) = (spec.experts, spec.top_k);
    let rows = logits.len() / e;
    let (mut ids, mut weights) = (Vec::with_capacity(rows * k), Vec::with_capacity(rows * k));
    let mut probs = vec![0f32; e];
    let mut order: Vec<u32> = Vec::with_capacity(e);
    for row in logits.chunks_exact(e) {
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut sum = 0f32;
        for (p, &l) in probs.iter_mut().zip(row) {
            *p = (l - max).exp();
            sum += *p;
        }
        probs.iter_mut().for_each(|p| *p /= sum);
        order.clear();
        order.extend(0..e as u32);
        // Stable: equal probabilities keep the lower index first.
        order.sort_by(|&a, &b| probs[b as usize].total_cmp(&probs[a as usize]));
        let chosen = &order[..k];
        let total: f32 = chosen.iter().map(|&i| probs[i as usize]).sum();
        for &i in chosen {
            ids.push(i);
            weights.push(if spec.renormalize { probs[i as usize] / total } else { probs[i as usize] });
        }
    }
    (ids, weights)
}

/// The routed (row, weight) pairs grouped by expert, experts in index order and rows in
/// order within each: `(expert, rows, weights)` for every expert some row takes.
pub fn group_by_expert(ids: &[u32], weights: &[f32], spec: MoeSpec) -> Vec<(usize, Vec<usize>, Vec<f32>)> {
    let mut groups: Vec<(Vec<usize>, Vec<f32>)> = vec![(Vec::new(), Vec::new()); spec.experts];
    for (pair, (&e, &w)) in ids.iter().zip(weights).enumerate() {
        groups[e as usize].0.push(pair / spec.top_k);
        groups[e as usize].1.push(w);
    }
    groups.into_iter().enumerate().filter(|(_, g)| !g.0.is_empty()).map(|(e, (r, w))| (e, r, w)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::Activation;

    fn spec(renormalize: bool) -> MoeSpec {
        MoeSpec { experts: 4, top_k: 2, renormalize, act: Activation::Silu }
    }

    #[test]
    fn routes_by_softmax_then_top_k_with_ties_to_the_lower_index() {
        // Row 0: experts 2 then 0; row 1: experts 1 and 3 tie with 0, the lower ones win.
        let logits = [1.0, 0.0, 2.0, -1.0, 0.5, 0.5, 0.0, 0.5];
        let (ids, w) = route(&logits, spec(false));
        assert_eq!(ids, [2, 0, 0, 1]);
        let e: Vec<f32> = [1f32, 0.0, 2.0, -1.0].iter().map(|v| (v - 2.0f32).exp()).collect();
        let sum: f32 = e.iter().sum();
        assert!((w[0] - e[2] / sum).abs() < 1e-7 && (w[1] - e[0] / sum).abs() < 1e-7);
        let (_, w) = route(&logits, spec(true));
        assert!((w[0] + w[1] - 1.0).abs() < 1e-6 && (w[2] - 0.5).abs() < 1e-6);
        let groups = group_by_expert(&ids, &w, spec(true));
        let rows: Vec<(usize, Vec<usize>)> = groups.iter().map(|(e, r, _)| (*e, r.clone())).collect();
        assert_eq!(rows, [(0, vec![0, 1]), (1, vec![1]), (2, vec![0])]);
    }
}
