// attnx::MawDepthGather plugin: shape rules (MawDepthSelect's inputs) and kernel launch (the
// rest of the IPluginV3 is common/plugin_v3.h).
#include "maw_depth_gather/maw_depth_gather_plugin.h"

#include "maw_depth_gather/maw_depth_gather_kernel.h"
#include "maw_depth_select/maw_depth_select_plugin.h"

namespace attnx
{
namespace plugin
{

void MawDepthGatherPlugin::checkShapes(nvinfer1::Dims const* inputs, ShapeChecker& c)
{
    MawDepthSelectPlugin::checkShapes(inputs, c); // same inputs, same rules
}

void MawDepthGatherPlugin::outputShapes(
    nvinfer1::DimsExprs const* inputs, nvinfer1::DimsExprs* outputs, nvinfer1::IExprBuilder& exprBuilder)
{
    auto const* one = exprBuilder.constant(1);
    for (int32_t o = 0; o < 2; ++o) // q_sel [B, H, Lq, 1], k_sel [B, H, Lk, 1]
    {
        auto const& x = inputs[o];
        outputs[o].nbDims = 4;
        outputs[o].d[0] = x.d[0];
        outputs[o].d[1] = x.d[1];
        outputs[o].d[2] = x.d[2];
        outputs[o].d[3] = one;
    }
    outputs[2].nbDims = 1; // depth [B]
    outputs[2].d[0] = inputs[0].d[0];
}

int MawDepthGatherPlugin::launch(int dtype, nvinfer1::PluginTensorDesc const* inputDesc, void const* const* inputs,
    void* const* outputs, void* /*workspace*/, cudaStream_t stream) const noexcept
{
    auto const& q = inputDesc[0].dims;
    auto const& k = inputDesc[1].dims;
    return attnx_maw_depth_gather(dtype, inputs[0], inputs[1], inputs[2], outputs[0], outputs[1],
        static_cast<int64_t*>(outputs[2]), q.d[0], q.d[1], q.d[2], k.d[2], q.d[3], stream);
}

} // namespace plugin
} // namespace attnx
