//! model
#[cfg(test)]
mod tests {
    #[test]
    fn tch_links() {
        let t = tch::Tensor::from_slice(&[1.0f32, 2.0, 3.0]);
        assert_eq!(t.sum(tch::Kind::Float).double_value(&[]), 6.0);
    }
}
