//! A CNN written with candle-nn, trained on a Stratus cluster.
//!
//! Two 3x3 convolutions (16 and 32 channels, each followed by ReLU and 2x2
//! max-pooling) and a linear layer, on 1x28x28 images (MNIST). Everything
//! that is not the network (data loading, compression, the exchange with
//! the servers, evaluation, checkpoints, metrics) comes from Stratus.
//!
//! ```sh
//! target/release/custom-cnn --print-layout      # the [model] section it needs
//! target/release/custom-cnn --config configs/custom-cnn.toml --rank 0
//! ```
//! (`scripts/local-cluster.sh --custom-cnn` runs the whole cluster.)

use candle_core::{Device, Module, Tensor};
use candle_nn::{conv2d, linear, Conv2dConfig, VarBuilder, VarMap};
use ps_worker::api::{named_vars, CustomModel};

fn build(device: &Device) -> candle_core::Result<CustomModel> {
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, candle_core::DType::F32, device);
    let same = Conv2dConfig {
        padding: 1,
        ..Conv2dConfig::default()
    };
    let conv1 = conv2d(1, 16, 3, same, vb.pp("conv1"))?;
    let conv2 = conv2d(16, 32, 3, same, vb.pp("conv2"))?;
    let head = linear(32 * 7 * 7, 10, vb.pp("head"))?;
    Ok(CustomModel::classifier(
        named_vars(&varmap),
        move |x: &Tensor, _phase| {
            let x = x.reshape((x.dim(0)?, 1, 28, 28))?;
            let x = conv1.forward(&x)?.relu()?.max_pool2d(2)?;
            let x = conv2.forward(&x)?.relu()?.max_pool2d(2)?;
            head.forward(&x.flatten_from(1)?)
        },
    ))
}

fn main() {
    ps_worker::api::main(build)
}
