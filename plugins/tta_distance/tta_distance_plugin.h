// TensorRT IPluginV3 for attnx::TtaDistance (plugin "TtaDistance", version "1", namespace "attnx"),
// and its creator.
//
//   q [B,H,Lq,Dh] T, k [B,H,Lk,Dh] T, trace [B|1,H|1,Dh,Dh] T -> dist [B,H,Lq,Lk] T
//   (T = float32 | float16, linear). Workspace: attnx_tta_distance_workspace_size at the max shapes.
#ifndef ATTNX_TTA_DISTANCE_PLUGIN_H
#define ATTNX_TTA_DISTANCE_PLUGIN_H

#include "common/plugin_v3.h"

namespace attnx
{
namespace plugin
{

class TtaDistancePlugin final : public PluginV3<TtaDistancePlugin>
{
public:
    using PluginV3::PluginV3;

    // IPluginV3OneBuild: fp32 scratch (kS, qq, kk) for the kernels, sized at the profile's max shapes.
    size_t getWorkspaceSize(nvinfer1::DynamicPluginTensorDesc const* inputs, int32_t nbInputs,
        nvinfer1::DynamicPluginTensorDesc const* outputs, int32_t nbOutputs) const noexcept override;

    static constexpr char const* kName = "TtaDistance";
    static constexpr char const* kIoNames[] = {"q", "k", "trace", "dist"};
    static constexpr int32_t kInputRanks[] = {4, 4, 4};
    static constexpr int32_t kNbInputs = 3;
    static constexpr int32_t kNbOutputs = 1;
    static constexpr int32_t kFirstInt64Output = -1; // none

    //! q [B,H,Lq,Dh], k [B,H,Lk,Dh], trace [B|1,H|1,Dh,Dh], Dh >= 1.
    static void checkShapes(nvinfer1::Dims const* inputs, ShapeChecker& c);
    static void outputShapes(
        nvinfer1::DimsExprs const* inputs, nvinfer1::DimsExprs* outputs, nvinfer1::IExprBuilder& exprBuilder);
    int launch(int dtype, nvinfer1::PluginTensorDesc const* inputDesc, void const* const* inputs, void* const* outputs,
        void* workspace, cudaStream_t stream) const noexcept;
};

using TtaDistanceCreator = PluginCreatorV3<TtaDistancePlugin>;

} // namespace plugin
} // namespace attnx

#endif // ATTNX_TTA_DISTANCE_PLUGIN_H
