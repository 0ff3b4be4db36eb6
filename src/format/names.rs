//! The naming rules of a checkpoint, one set for reading and writing.
//!
//! Parameter names are unique across trainable and frozen; optimizer group names are unique;
//! within a group a parameter has one optimizer state; within a state each momentum name is
//! unique. Property names may repeat: ONNX Runtime keeps the last, and so does ortckpt. The
//! decoder reports a clash as a malformed file, the encoder as an invalid state, in the
//! same words and with the same scope.

use super::model::Checkpoint;
use crate::error::Error;

/// A name that appears twice where it must be unique.
#[derive(Debug, PartialEq, Eq)]
pub struct Clash {
    /// What kind of name: "parameter", "optimizer group", ...
    pub what: &'static str,
    pub name: String,
    /// Where it repeats, for the error's tensor field: a group, or `group/parameter`.
    pub scope: Option<String>,
}

impl Clash {
    /// The clash as an error made by `make` (`Error::malformed` on read, `Error::invalid_state`
    /// on write), scoped like any tensor error.
    pub fn into_error(self, make: impl FnOnce(String) -> Error) -> Error {
        let error = make(format!("duplicate {} name '{}'", self.what, self.name));
        match &self.scope {
            Some(scope) => error.in_tensor_scope(scope),
            None => error,
        }
    }
}

/// The first name `ckpt` repeats against the rules, if any.
pub fn first_clash<D>(ckpt: &Checkpoint<D>) -> Option<Clash> {
    let clash = |what, name: &str, scope: Option<String>| Clash {
        what,
        name: name.to_owned(),
        scope,
    };
    let params = ckpt.trainable.iter().chain(&ckpt.frozen);
    if let Some(name) = first_duplicate(params.map(|t| t.name.as_str())) {
        return Some(clash("parameter", name, None));
    }
    let groups = ckpt.optimizer_groups.iter().map(|g| g.name.as_str());
    if let Some(name) = first_duplicate(groups) {
        return Some(clash("optimizer group", name, None));
    }
    for g in &ckpt.optimizer_groups {
        let states = g.states.iter().map(|s| s.param_name.as_str());
        if let Some(name) = first_duplicate(states) {
            return Some(clash(
                "optimizer state for parameter",
                name,
                Some(g.name.clone()),
            ));
        }
        for s in &g.states {
            if let Some(name) = first_duplicate(s.momentums.iter().map(|m| m.name.as_str())) {
                let scope = format!("{}/{}", g.name, s.param_name);
                return Some(clash("momentum", name, Some(scope)));
            }
        }
    }
    None
}

/// The first name that repeats in `names`, if any.
fn first_duplicate<'a>(names: impl Iterator<Item = &'a str>) -> Option<&'a str> {
    // Sorted first: names come sorted (ONNX Runtime sorts them), which the sort finds in
    // one pass, and most files repeat nothing (hashing every name cost a tenth of a load
    // of 16k tensors). The first repeat in order is looked for only when there is one.
    let names: Vec<&str> = names.collect();
    let mut sorted = names.clone();
    sorted.sort_unstable();
    if sorted.windows(2).all(|pair| pair[0] != pair[1]) {
        return None;
    }
    let mut seen = std::collections::HashSet::new();
    names.into_iter().find(|name| !seen.insert(*name))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::{DataType, OptimizerGroup, ParameterOptimizerState, Tensor};
    use crate::ErrorKind;

    fn tensor(name: &str) -> Tensor<()> {
        Tensor {
            name: name.to_owned(),
            data_type: DataType::Float,
            dims: vec![],
            data: (),
        }
    }

    fn group(name: &str, states: &[(&str, &[&str])]) -> OptimizerGroup<()> {
        OptimizerGroup {
            name: name.to_owned(),
            step: 0,
            initial_learning_rate: 0.0,
            states: states
                .iter()
                .map(|(p, ms)| ParameterOptimizerState {
                    param_name: (*p).to_owned(),
                    momentums: ms.iter().map(|m| tensor(m)).collect(),
                })
                .collect(),
        }
    }

    #[test]
    fn each_rule_names_the_clash_and_where() {
        let mut ckpt = Checkpoint::<()>::default();
        ckpt.trainable.push(tensor("w"));
        ckpt.frozen.push(tensor("b"));
        ckpt.optimizer_groups
            .push(group("g", &[("w", &["m0", "m1"])]));
        assert_eq!(first_clash(&ckpt), None);

        ckpt.optimizer_groups[0].states[0]
            .momentums
            .push(tensor("m0"));
        let e = first_clash(&ckpt).unwrap().into_error(Error::malformed);
        assert!(matches!(e.kind(), ErrorKind::Malformed(m) if m == "duplicate momentum name 'm0'"));
        assert_eq!(e.tensor(), Some("g/w"));

        ckpt.optimizer_groups
            .push(group("g", &[("w", &["m0"]), ("w", &["m0"])]));
        ckpt.optimizer_groups[0].states[0].momentums.pop();
        let c = first_clash(&ckpt).unwrap();
        assert_eq!((c.what, c.name.as_str()), ("optimizer group", "g"));

        ckpt.optimizer_groups[1].name = "h".to_owned();
        let e = first_clash(&ckpt).unwrap().into_error(Error::invalid_state);
        assert!(
            matches!(e.kind(), ErrorKind::InvalidState(m) if m == "duplicate optimizer state for parameter name 'w'")
        );
        assert_eq!(e.tensor(), Some("h"));

        ckpt.frozen.push(tensor("w"));
        let c = first_clash(&ckpt).unwrap();
        assert_eq!((c.what, c.name.as_str(), c.scope), ("parameter", "w", None));
    }

    #[test]
    fn the_first_repeat_in_order_is_named_whatever_the_sort_finds_first() {
        let names = ["z", "b", "a", "b", "z", "a"];
        assert_eq!(first_duplicate(names.into_iter()), Some("b"));
        assert_eq!(first_duplicate(["a", "c", "b"].into_iter()), None);
        assert_eq!(first_duplicate(std::iter::empty()), None);
        let many: Vec<String> = (0..20_000).map(|i| format!("block{i}.weight")).collect();
        assert_eq!(first_duplicate(many.iter().map(String::as_str)), None);
        let again = many.iter().chain(&many[7..8]).map(String::as_str);
        assert_eq!(first_duplicate(again), Some("block7.weight"));
    }
}
