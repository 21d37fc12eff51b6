// TensorRT IPluginV3 for attnx::MawDepthSelect (plugin "MawDepthSelect", version "1", namespace "attnx"),
// and its creator.
//
//   q_depth [B,H,Lq,d] T, k_depth [B,H,Lk,d] T, policy_logits [B,d] T; scale: float
//   -> logits [B,H,Lq,Lk] T, depth [B] int64          (T = float32 | float16, linear)
#ifndef ATTNX_MAW_DEPTH_SELECT_PLUGIN_H
#define ATTNX_MAW_DEPTH_SELECT_PLUGIN_H

#include "common/plugin_v3.h"

namespace attnx
{
namespace plugin
{

struct MawDepthSelectParams
{
    float scale{0.0f};
};

class MawDepthSelectPlugin final : public PluginV3<MawDepthSelectPlugin, MawDepthSelectParams>
{
public:
    using PluginV3::PluginV3;

    static constexpr char const* kName = "MawDepthSelect";
    static constexpr int32_t kNbInputs = 3;
    static constexpr int32_t kNbOutputs = 2;
    static constexpr int32_t kFirstInt64Output = 1;
    static constexpr char const* kIoNames[] = {"q_depth", "k_depth", "policy_logits", "logits", "depth"};
    static constexpr int32_t kInputRanks[] = {4, 4, 2};

    //! The float attribute `scale` (required, finite).
    static void describeFields(MawDepthSelectParams* params, std::vector<nvinfer1::PluginField>& out);
    static bool parseFields(std::string const& node, nvinfer1::PluginFieldCollection const* fc, MawDepthSelectParams& params);

    //! q_depth [B,H,Lq,d], k_depth [B,H,Lk,d], policy_logits [B,d], d >= 1 (MawDepthGather's rules too).
    static void checkShapes(nvinfer1::Dims const* inputs, ShapeChecker& c);
    static void outputShapes(
        nvinfer1::DimsExprs const* inputs, nvinfer1::DimsExprs* outputs, nvinfer1::IExprBuilder& exprBuilder);
    int launch(int dtype, nvinfer1::PluginTensorDesc const* inputDesc, void const* const* inputs, void* const* outputs,
        void* workspace, cudaStream_t stream) const noexcept;
};

using MawDepthSelectCreator = PluginCreatorV3<MawDepthSelectPlugin>;

} // namespace plugin
} // namespace attnx

#endif // ATTNX_MAW_DEPTH_SELECT_PLUGIN_H
