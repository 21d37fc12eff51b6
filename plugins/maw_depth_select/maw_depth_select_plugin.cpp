// attnx::MawDepthSelect plugin: the op's attribute, shape rules and kernel launch (the rest of
// the IPluginV3 is common/plugin_v3.h).
#include "maw_depth_select/maw_depth_select_plugin.h"

#include "maw_depth_select/maw_depth_select_kernel.h"

#include <cmath>
#include <cstring>

namespace attnx
{
namespace plugin
{

void MawDepthSelectPlugin::describeFields(MawDepthSelectParams* params, std::vector<nvinfer1::PluginField>& out)
{
    out.emplace_back("scale", params != nullptr ? &params->scale : nullptr, nvinfer1::PluginFieldType::kFLOAT32, 1);
}

bool MawDepthSelectPlugin::parseFields(
    std::string const& node, nvinfer1::PluginFieldCollection const* fc, MawDepthSelectParams& params)
{
    bool haveScale{false};
    double scale{0.0};
    if (fc != nullptr && fc->fields != nullptr)
    {
        for (int32_t i = 0; i < fc->nbFields; ++i)
        {
            auto const& field = fc->fields[i];
            if (field.name != nullptr && std::strcmp(field.name, "scale") == 0)
            {
                if (!readScalarField(field, scale))
                {
                    log(nvinfer1::ILogger::Severity::kERROR, nodeMessage(kName, node, "attribute 'scale' must be a float"));
                    return false;
                }
                haveScale = true;
            }
        }
    }
    if (!haveScale || !std::isfinite(scale))
    {
        log(nvinfer1::ILogger::Severity::kERROR, nodeMessage(kName, node, "missing or non-finite float attribute 'scale'"));
        return false;
    }
    params.scale = static_cast<float>(scale);
    return true;
}

void MawDepthSelectPlugin::checkShapes(nvinfer1::Dims const* in, ShapeChecker& c)
{
    // Inputs 0 q_depth [B,H,Lq,d], 1 k_depth [B,H,Lk,d], 2 policy_logits [B,d].
    c.sameDims("batch size", in, {{0, 0}, {1, 0}, {2, 0}}, kIoNames);
    c.sameDims("number of heads", in, {{0, 1}, {1, 1}}, kIoNames);
    c.sameDims("depth size", in, {{0, 3}, {1, 3}, {2, 1}}, kIoNames);
    c.atLeast("depth size policy_logits[1]", in[2].d[1], 1);
}

void MawDepthSelectPlugin::outputShapes(
    nvinfer1::DimsExprs const* inputs, nvinfer1::DimsExprs* outputs, nvinfer1::IExprBuilder& /*exprBuilder*/)
{
    auto const& q = inputs[0];
    auto const& k = inputs[1];
    outputs[0].nbDims = 4; // logits [B, H, Lq, Lk]
    outputs[0].d[0] = q.d[0];
    outputs[0].d[1] = q.d[1];
    outputs[0].d[2] = q.d[2];
    outputs[0].d[3] = k.d[2];
    outputs[1].nbDims = 1; // depth [B]
    outputs[1].d[0] = q.d[0];
}

int MawDepthSelectPlugin::launch(int dtype, nvinfer1::PluginTensorDesc const* inputDesc, void const* const* inputs,
    void* const* outputs, void* /*workspace*/, cudaStream_t stream) const noexcept
{
    auto const& q = inputDesc[0].dims;
    auto const& k = inputDesc[1].dims;
    return attnx_maw_depth_select(dtype, inputs[0], inputs[1], inputs[2], outputs[0], static_cast<int64_t*>(outputs[1]),
        q.d[0], q.d[1], q.d[2], k.d[2], q.d[3], params().scale, stream);
}

} // namespace plugin
} // namespace attnx
