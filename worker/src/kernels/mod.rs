//! Hand-written CPU kernels for the layered models, working on plain `f32`
//! slices with buffers reused across steps.
//!
//! * [`conv`]: 2-d convolution (NHWC activations, OIHW weights): forward,
//!   gradient with respect to the input and gradient with respect to the
//!   weight, each one or a few matrix products on an unfolded input.

pub mod conv;
