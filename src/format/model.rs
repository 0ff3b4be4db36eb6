//! The checkpoint as this crate sees it: one shape for both directions.
//!
//! `D` is where a tensor's values are: [`Stored`] after decoding (byte ranges into
//! the mapped file), [`Payload`] before encoding (borrowed from the caller).

use super::dtype::DataType;

/// One named tensor.
#[derive(Clone, Debug, PartialEq)]
pub struct Tensor<D> {
    pub name: String,
    pub data_type: DataType,
    pub dims: Vec<i64>,
    pub data: D,
}

/// The momentums of one parameter (AdamW: `momentum0`, `momentum1`).
#[derive(Clone, Debug, PartialEq)]
pub struct ParameterOptimizerState<D> {
    pub param_name: String,
    pub momentums: Vec<Tensor<D>>,
}

/// One optimizer parameter group (ONNX Runtime names its only one `group0`).
#[derive(Clone, Debug, PartialEq)]
pub struct OptimizerGroup<D> {
    pub name: String,
    pub step: i64,
    pub initial_learning_rate: f32,
    pub states: Vec<ParameterOptimizerState<D>>,
}

/// User properties. Kept as lists, in file order: ONNX Runtime lets a later
/// entry of the same name win, and so does the Python layer.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PropertyBag {
    pub ints: Vec<(String, i64)>,
    pub floats: Vec<(String, f32)>,
    pub strings: Vec<(String, String)>,
}

impl PropertyBag {
    pub fn is_empty(&self) -> bool {
        self.ints.is_empty() && self.floats.is_empty() && self.strings.is_empty()
    }
}

/// A whole checkpoint.
#[derive(Clone, Debug, PartialEq)]
pub struct Checkpoint<D> {
    /// The format version decoded (1 or 2); saves always write version 2.
    pub version: i32,
    pub trainable: Vec<Tensor<D>>,
    pub frozen: Vec<Tensor<D>>,
    /// Tensors carry names and types only (dims and data empty).
    pub is_nominal: bool,
    /// Set on decode when the module state says its bytes are in `<path>.data`.
    pub has_external_data: bool,
    pub optimizer_groups: Vec<OptimizerGroup<D>>,
    pub properties: PropertyBag,
}

impl<D> Default for Checkpoint<D> {
    fn default() -> Self {
        Checkpoint {
            version: super::CHECKPOINT_VERSION,
            trainable: Vec::new(),
            frozen: Vec::new(),
            is_nominal: false,
            has_external_data: false,
            optimizer_groups: Vec::new(),
            properties: PropertyBag::default(),
        }
    }
}

/// Where a decoded tensor's values are.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Stored {
    /// `len` bytes at `offset` in the checkpoint file.
    Inline { offset: usize, len: usize },
    /// `len` bytes at `offset` in the external data file `<path>.data`.
    External { offset: u64, len: u64 },
    /// STRING tensors: one string per element.
    Strings(Vec<String>),
    /// Nominal checkpoints hold no values.
    Absent,
}

/// The values of a tensor to encode, borrowed from the caller.
#[derive(Clone, Debug, PartialEq)]
pub enum Payload<'a> {
    /// Little-endian element bytes, exactly `byte_len(element_count(dims))` long.
    Bytes(&'a [u8]),
    Strings(Vec<String>),
    /// Nominal checkpoints hold no values.
    Absent,
}

impl<D> Checkpoint<D> {
    /// Every tensor (parameters, then momentums) with its role, for checks and copies.
    pub fn tensors(&self) -> impl Iterator<Item = &Tensor<D>> {
        let momentums = self
            .optimizer_groups
            .iter()
            .flat_map(|g| g.states.iter().flat_map(|s| s.momentums.iter()));
        self.trainable
            .iter()
            .chain(self.frozen.iter())
            .chain(momentums)
    }

    /// Every tensor with the name errors should give it: a parameter's own name, a
    /// momentum's `group/param/momentum` (momentum names repeat across parameters).
    /// Every tensor in [`tensors_named`](Self::tensors_named)'s order, without the names.
    pub fn tensors_named_lazily(&self) -> impl Iterator<Item = &Tensor<D>> {
        let params = self.trainable.iter().chain(&self.frozen);
        let momentums = self
            .optimizer_groups
            .iter()
            .flat_map(|g| g.states.iter().flat_map(|s| s.momentums.iter()));
        params.chain(momentums)
    }

    pub fn tensors_named(&self) -> impl Iterator<Item = (String, &Tensor<D>)> {
        let params = self
            .trainable
            .iter()
            .chain(&self.frozen)
            .map(|t| (t.name.clone(), t));
        let momentums = self.optimizer_groups.iter().flat_map(|g| {
            g.states.iter().flat_map(move |s| {
                s.momentums
                    .iter()
                    .map(move |m| (format!("{}/{}/{}", g.name, s.param_name, m.name), m))
            })
        });
        params.chain(momentums)
    }

    /// Sorts everything the way ONNX Runtime's state-path saver writes it:
    /// parameters, groups, per-parameter states, momentums and properties by name.
    pub fn sort_like_ort_state_path(&mut self) {
        self.trainable.sort_by(|a, b| a.name.cmp(&b.name));
        self.frozen.sort_by(|a, b| a.name.cmp(&b.name));
        self.optimizer_groups.sort_by(|a, b| a.name.cmp(&b.name));
        for group in &mut self.optimizer_groups {
            group.states.sort_by(|a, b| a.param_name.cmp(&b.param_name));
            for state in &mut group.states {
                state.momentums.sort_by(|a, b| a.name.cmp(&b.name));
            }
        }
        self.properties.ints.sort_by(|a, b| a.0.cmp(&b.0));
        self.properties.floats.sort_by(|a, b| a.0.cmp(&b.0));
        self.properties.strings.sort_by(|a, b| a.0.cmp(&b.0));
    }

    /// A copy sorted as [`Checkpoint::sort_like_ort_state_path`] sorts (tensor data are
    /// cloned as they are: for a `Payload`, borrowed slices, not bytes).
    pub fn sorted_like_ort_state_path(&self) -> Self
    where
        D: Clone,
    {
        let mut sorted = self.clone();
        sorted.sort_like_ort_state_path();
        sorted
    }

    /// The same checkpoint with every tensor's data mapped by `f` (which may fail).
    pub fn try_map_data<E, F, T>(&self, mut f: F) -> Result<Checkpoint<T>, E>
    where
        F: FnMut(&Tensor<D>) -> Result<T, E>,
    {
        let mut map_tensors = |ts: &[Tensor<D>]| -> Result<Vec<Tensor<T>>, E> {
            ts.iter()
                .map(|t| {
                    Ok(Tensor {
                        name: t.name.clone(),
                        data_type: t.data_type,
                        dims: t.dims.clone(),
                        data: f(t)?,
                    })
                })
                .collect()
        };
        let trainable = map_tensors(&self.trainable)?;
        let frozen = map_tensors(&self.frozen)?;
        let mut optimizer_groups = Vec::with_capacity(self.optimizer_groups.len());
        for g in &self.optimizer_groups {
            let mut states = Vec::with_capacity(g.states.len());
            for s in &g.states {
                states.push(ParameterOptimizerState {
                    param_name: s.param_name.clone(),
                    momentums: map_tensors(&s.momentums)?,
                });
            }
            optimizer_groups.push(OptimizerGroup {
                name: g.name.clone(),
                step: g.step,
                initial_learning_rate: g.initial_learning_rate,
                states,
            });
        }
        Ok(Checkpoint {
            version: self.version,
            trainable,
            frozen,
            is_nominal: self.is_nominal,
            has_external_data: self.has_external_data,
            optimizer_groups,
            properties: self.properties.clone(),
        })
    }
}
